"""links of the airflow-gpu-resilience provider."""
