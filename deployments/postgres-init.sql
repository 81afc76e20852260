-- The MLflow database next to Prefect's (POSTGRES_DB creates "prefect"), owned by the same user.
CREATE DATABASE mlflow OWNER cpuforge;
