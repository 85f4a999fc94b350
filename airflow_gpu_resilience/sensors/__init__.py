"""sensors of the airflow-gpu-resilience provider."""
