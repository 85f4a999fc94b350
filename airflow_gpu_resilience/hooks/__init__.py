"""hooks of the airflow-gpu-resilience provider."""
