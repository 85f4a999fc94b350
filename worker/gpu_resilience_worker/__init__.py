"""Bundled PyTorch worker: checkpointed, preemption-safe training for Cloud Run GPU jobs.

Depends on torch and the standard library only. Run it as ``python -m gpu_resilience_worker train``.
"""

__version__ = "0.1.0"
