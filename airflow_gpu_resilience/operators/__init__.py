"""operators of the airflow-gpu-resilience provider."""
