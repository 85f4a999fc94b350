"""Integrations of the commit protocol and the SIGTERM handling with training frameworks.

Each module imports its framework and needs the distribution's extra of the same name:
:mod:`~gpu_resilience_worker.integrations.transformers` (``[transformers]``) and
:mod:`~gpu_resilience_worker.integrations.lightning` (``[lightning]``). The protocol itself is
:mod:`gpu_resilience_worker.artifacts`; these modules only call it from the frameworks' hooks."""
