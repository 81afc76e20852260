"""The code MLflow runs to load a registered cpuforge text model ("models from code", see text_model.py)."""

import mlflow

from cpuforge.tasks.infra.text_model import TextModel

mlflow.models.set_model(TextModel())
