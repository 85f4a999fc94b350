"""triggers of the airflow-gpu-resilience provider."""
