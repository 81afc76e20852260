"""The registered model as MLflow serves it: a pyfunc model that takes prompts and returns text.

Its artifacts are the final ONNX decoder and its tokenizer.json; its code is cpuforge's own
runtime (cpuforge.models.runtime), loaded through MLflow's "models from code" (text_model_code.py
sets the model) rather than a pickle, so a version stays loadable when this class changes. So
``mlflow models serve -m models:/cpuforge-lm@champion --env-manager local`` answers

    POST /invocations {"dataframe_records": [{"prompt": "def "}], "params": {"max_new_tokens": 8}}

with {"predictions": ["<the continuation>"]}, wherever cpuforge is installed.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import yaml

from cpuforge.models import onnx_files
from cpuforge.models.runtime import LanguageModel, load_language_model
from cpuforge.tasks.infra import tracking

ARTIFACT_MODEL, ARTIFACT_TOKENIZER = "model", "tokenizer"
PROMPT = "prompt"
CODE = Path(__file__).with_name("text_model_code.py")
# The generation parameters a request may set, with their defaults (those of `cpuforge generate`).
# seed -1: no fixed seed; top_k 0 and top_p 1: that filter is off.
PARAMS: dict[str, tuple[str, Any]] = {
    "max_new_tokens": ("long", 64), "temperature": ("double", 0.8), "top_k": ("long", 40),
    "top_p": ("double", 1.0), "stop": ("string", []), "seed": ("long", -1),
}
REQUIREMENTS = ("cpuforge", "mlflow", "numpy", "pandas", "onnx", "onnxruntime", "tokenizers", "torch")


class TextModel(mlflow.pyfunc.PythonModel):
    """Prompts in (a `prompt` column, a list of strings or one string), one continuation per prompt out."""

    def load_context(self, context) -> None:
        self.lm: LanguageModel = load_language_model(Path(context.artifacts[ARTIFACT_MODEL]))

    # Annotated DataFrame, which MLflow takes as "no conversion": the signature has already made any
    # accepted request (records, a list of strings) a frame with a `prompt` column.
    def predict(self, context, model_input: pd.DataFrame, params=None) -> list[str]:
        p = {name: default for name, (_, default) in PARAMS.items()} | (params or {})
        if int(p["max_new_tokens"]) <= 0:
            raise mlflow.MlflowException.invalid_parameter_value("max_new_tokens must be positive")
        if float(p["temperature"]) < 0:
            raise mlflow.MlflowException.invalid_parameter_value("temperature must be 0 (greedy) or positive")
        if int(p["top_k"]) < 0 or not 0 < float(p["top_p"]) <= 1:
            raise mlflow.MlflowException.invalid_parameter_value(
                "top_k must be 0 (off) or a positive number of tokens, and top_p in (0, 1] (1: off)")
        stop = [p["stop"]] if isinstance(p["stop"], str) else list(p["stop"] or [])
        seed = int(p["seed"])
        try:
            return [self.lm.complete(prompt, int(p["max_new_tokens"]), float(p["temperature"]), int(p["top_k"]) or None,
                                     float(p["top_p"]), stop, seed if seed >= 0 else None)
                    for prompt in prompts_of(model_input)]
        except ValueError as exc:  # an empty prompt, or one longer than the context
            raise mlflow.MlflowException.invalid_parameter_value(str(exc)) from None


def prompts_of(model_input: Any) -> list[str]:
    """The prompts of a request, however it was shaped."""
    if isinstance(model_input, pd.DataFrame):
        column = PROMPT if PROMPT in model_input.columns else model_input.columns[0]
        values = model_input[column].tolist()
    elif isinstance(model_input, str):
        values = [model_input]
    elif isinstance(model_input, dict):
        values = model_input[PROMPT]
        values = [values] if isinstance(values, str) else list(values)
    else:
        values = list(model_input)
    if not all(isinstance(v, str) for v in values):
        raise mlflow.MlflowException.invalid_parameter_value(f"each {PROMPT} must be a string")
    return values


def signature():
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    params = [ParamSpec(name, dtype, default, shape=(-1,) if isinstance(default, list) else None)
              for name, (dtype, default) in PARAMS.items()]
    return ModelSignature(inputs=Schema([ColSpec("string", PROMPT)]), outputs=Schema([ColSpec("string")]),
                          params=ParamSchema(params))


def requirements() -> list[str]:
    """The installed versions this model was registered with (cpuforge itself included: it is the code).
    Local version labels go (torch 2.13.0+cpu is torch==2.13.0 to pip)."""
    return [f"{name}=={importlib.metadata.version(name).split('+')[0]}" for name in REQUIREMENTS]


def log_text_model(onnx: Path, tokenizer: Path, registered_model_name: str, metadata: dict[str, Any]) -> str:
    """Log the model as artifact "model" of the active run and register it; returns the new version."""
    # A large graph's weights file is an artifact of its own: MLflow puts each under its name, beside the graph.
    weights = {f"weights_{i}": str(onnx.parent / name) for i, name in enumerate(onnx_files.external_files(onnx))}
    info = mlflow.pyfunc.log_model(
        name="model", python_model=str(CODE),
        artifacts={ARTIFACT_MODEL: str(onnx), ARTIFACT_TOKENIZER: str(tokenizer), **weights},
        signature=signature(), input_example=(pd.DataFrame({PROMPT: ["def "]}), {"max_new_tokens": 8, "temperature": 0.0}),
        pip_requirements=requirements(), registered_model_name=registered_model_name, metadata=metadata)
    return str(info.registered_model_version)


def model_file(folder: Path) -> Path:
    """What cpuforge's runtime loads in a downloaded registered model: the ONNX artifact of a text model,
    or the folder itself (versions registered before, with MLflow's onnx flavor, hold model.onnx there)."""
    mlmodel = folder / "MLmodel"
    if mlmodel.is_file():
        artifacts = yaml.safe_load(mlmodel.read_text()).get("flavors", {}).get("python_function", {}).get("artifacts", {})
        if ARTIFACT_MODEL in artifacts:
            return folder / artifacts[ARTIFACT_MODEL]["path"]
    return folder


def download(uri: str, dst: Path, tracking_uri: str | None = None) -> Path:
    """Download a registered model (models:/NAME@alias, models:/NAME/VERSION, runs:/ID/PATH): what to load."""
    return model_file(tracking.download(uri, dst, tracking_uri))
