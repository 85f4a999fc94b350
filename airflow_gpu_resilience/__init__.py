"""Airflow provider for long PyTorch GPU jobs on Google Cloud Run that survive maintenance preemptions."""

__version__ = "0.1.0"
