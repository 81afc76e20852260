"""The one validated configuration of a cpuforge run.

Resolution order (later wins): field defaults < profile YAML < ``--config`` YAML <
``--set section.key=value`` overrides. Every section rejects unknown keys, so a typo is an
error before any work starts, never a silently ignored setting.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from cpuforge.models.config import SIZES, LlamaConfig, ModelConfigError, llama_fields
from cpuforge.tasks.records.errors import ConfigError

PROFILES_DIR = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = "demo"

# Byte-level BPE needs all 256 byte symbols before it can learn a single merge.
BYTE_ALPHABET = 256


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return value


# An empty name or path is never meant: '' as a path is the current folder, '' as a name fails in MLflow.
NonBlank = Annotated[str, AfterValidator(_not_blank)]
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


class Section(BaseModel):
    # inf and nan pass every bound check (nan compares false, inf is "greater than 0") but no setting means them.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class DataConfig(Section):
    source: NonBlank = Field(
        "stdlib",
        description="'stdlib' (the running interpreter's standard library source, no download), "
        "a file, folder or glob of .txt/.md/.py/.jsonl/.json/.csv/.parquet, "
        "or 'hf:<dataset id>' for a Hugging Face hub dataset (needs network).",
    )
    text_field: NonBlank = Field("text", description="Column holding the text in structured files and hub datasets.")
    hf_subset: NonBlank | None = Field(None, description="Hub dataset configuration (subset) name.")
    hf_split: NonBlank = Field("train", description="Hub dataset split to read.")
    hf_revision: NonBlank | None = Field(
        None, description="Hub dataset revision (branch, tag or commit). Every run resolves it (empty: the default "
        "branch) to a commit, reads that commit and records it: a new commit re-tokenizes, the same one reuses.")
    max_docs: int | None = Field(None, gt=0, description="Read at most this many documents (files or records).")
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5, description="Share of documents held out for validation.")
    split_seed: int = Field(0, description="Seed of the hash-based train/val assignment.")
    chunk_bytes: int = Field(
        262_144, ge=1024, description="Documents longer than this are cut at line boundaries into several."
    )
    min_docs: int = Field(
        20, ge=2, description="A corpus with fewer documents is cut into about this many chunks so it can be split."
    )
    encode_runner: Literal["auto", "process", "dask", "single"] = Field(
        "auto",
        description="Where a split bigger than data.piece_bytes is encoded: 'process' (a local process pool, a "
        "Prefect task per piece), 'dask' (a Dask cluster through prefect-dask), 'single' (this process) or 'auto' "
        "('single' on 2 cores or fewer, where the pool measured slower than one process, else 'process'). The "
        "shards are the same byte for byte either way.",
    )
    dask_address: NonBlank | None = Field(
        None, description="Dask scheduler address (tcp://host:8786) to encode on; implies encode_runner=dask. "
        "With encode_runner=dask and no address, a local cluster is started for the stage.")
    encode_workers: int = Field(0, ge=0, description="Processes of the local pool or cluster (0 = the cores available).")
    piece_bytes: int = Field(32 * 2**20, gt=0, description="Characters per parallel piece; a smaller split is encoded "
                             "in this process.")


class TokenizerConfig(Section):
    vocab_size: int = Field(4096, description="Vocabulary size of the byte-level BPE trained on the train split.")
    path: NonBlank | None = Field(None, description="Use this existing tokenizer.json instead of training one.")
    eod_token: NonBlank = Field("<|endoftext|>", description="Token placed between documents.")
    min_frequency: int = Field(2, ge=1, description="A merge must occur this often to be learned.")
    train_max_bytes: int = Field(
        64 * 2**20, gt=0, description="Train the tokenizer on at most this many bytes of the train split."
    )

    @model_validator(mode="after")
    def _vocab_holds_the_alphabet(self) -> TokenizerConfig:
        smallest = BYTE_ALPHABET + 1  # the byte alphabet plus the end-of-document token
        if self.path is None and self.vocab_size < smallest:
            raise ValueError(
                f"tokenizer.vocab_size={self.vocab_size} is smaller than the byte alphabet ({BYTE_ALPHABET}) "
                f"plus the end-of-document token; use at least {smallest}"
            )
        if self.vocab_size > 2**32 - 1:
            raise ValueError("tokenizer.vocab_size must fit in uint32")
        return self


# The fields `model.size: auto` chooses (tasks/engine/sizing.py); the others take LlamaConfig's defaults.
AUTO_FIELDS = ("n_layer", "n_head", "n_kv_head", "d_model", "d_mlp")
AUTO = "auto"
AUTO_FIELD_HELP = (" With model.size=auto: chosen for the training budget when the run starts, unless set here "
                   "(a value set here is kept; auto fills only the fields left empty).")


class _ModelSection(Section):
    @property
    def unresolved(self) -> bool:
        """size=auto with a shape field still to be chosen (tasks/engine/sizing.py resolve_auto_size)."""
        return any(getattr(self, name) is None for name in AUTO_FIELDS)

    def or_named(self, size: str) -> _ModelSection:
        """This section, or while size=auto is unresolved the named size with the fields set here (for
        benchmarks that compare setups at one fixed shape, where a measured choice would move it)."""
        if not self.unresolved:
            return self
        return type(self)(**{**self.model_dump(exclude_none=True), "size": size})

    def shape(self, vocab_size: int) -> LlamaConfig:
        """The LlamaConfig this section describes, for a tokenizer of this many ids."""
        if self.unresolved:
            raise ConfigError("model.size=auto: the shape is chosen when a run starts (resolve_auto_size), not yet here")
        return LlamaConfig(vocab_size=vocab_size, **self.model_dump(exclude={"size"}))


def _model_section() -> type[_ModelSection]:
    """The `model` section, made from LlamaConfig (the one description of a shape): a named size, and
    any of LlamaConfig's fields set otherwise. Empty fields take the size's values once validated, so
    `cfg.model.block_size` is always the resolved shape; LlamaConfig's own checks validate it. With
    size=auto the AUTO_FIELDS left empty stay empty until the run chooses them for its budget."""
    overridable = {
        f.name: (f.type_hint | None,
                 Field(None, description=f.metadata["doc"] + (AUTO_FIELD_HELP if f.name in AUTO_FIELDS else "")))
        for f in llama_fields() if f.name != "vocab_size"
    }
    size_names = (AUTO, *SIZES)
    defaults = {f.name: f.default for f in dataclass_fields(LlamaConfig)}

    def resolve(self: Section) -> Section:
        set_fields = {name: getattr(self, name) for name in overridable if getattr(self, name) is not None}
        try:
            if self.size != AUTO:
                shape = LlamaConfig.named(self.size, vocab_size=BYTE_ALPHABET, **set_fields)
            elif all(name in set_fields for name in AUTO_FIELDS):  # fixed by hand, or already chosen
                shape = LlamaConfig(vocab_size=BYTE_ALPHABET, **set_fields)
            else:  # the rest of the shape is known now; AUTO_FIELDS stay empty until the run chooses them
                for name in overridable:
                    if name not in AUTO_FIELDS and name not in set_fields:
                        self.__dict__[name] = defaults[name]
                return self
        except ModelConfigError as exc:  # name the settings as they are written: model.n_head
            raise ValueError(re.sub(rf"\b({'|'.join(overridable)})=", r"model.\1=", str(exc))) from None
        for name in overridable:  # validate_assignment would re-run this validator: set the values directly
            self.__dict__[name] = getattr(shape, name)
        return self

    return create_model(
        "ModelConfig", __base__=_ModelSection, __doc__="The model's shape: a named size, with any field set otherwise.",
        __validators__={"_resolve": model_validator(mode="after")(resolve)},
        size=(Literal[size_names], Field("demo", description=f"Named size: {', '.join(SIZES)} (models/config.py), "
              "or 'auto': the shape that trains near compute-optimal in train's budget on this machine, chosen from "
              "measured training speed when the run starts (tasks/engine/sizing.py; the choice and why are logged). "
              "Any model field set as well stays as set.")),
        **overridable,
    )


ModelConfig = _model_section()


class TrainConfig(Section):
    batch_size: int = Field(8, gt=0, description="Sequences per micro-batch.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    lr: float = Field(2e-3, gt=0, description="Peak learning rate (AdamW's: all parameters, or with "
                      "optimizer=muon the embedding/LM head and norms).")
    min_lr: float = Field(2e-4, ge=0, description="Learning rate at the end of the decay (muon_lr's end is "
                          "scaled alike).")
    warmup_steps: int = Field(30, ge=0, description="Linear warm-up steps.")
    optimizer: Literal["auto", "adamw", "muon"] = Field(
        "auto", description="'muon': Muon (orthogonalised momentum, tasks/engine/muon.py) for the 2-D matrices "
        "inside the blocks and AdamW for the embedding/LM head and norms; 'adamw' for every parameter; 'auto' "
        "(default): muon, except adamw with strategy=fsdp (Muon needs whole matrices, FSDP shards them; a run "
        "resumes only under the optimizer that wrote its checkpoint). Pretraining only: recovery has "
        "recover.optimizer.")
    muon_lr: float = Field(2e-3, gt=0, description="Muon's peak learning rate. Its updates are scaled to AdamW's "
                           "RMS (torch's 'match_rms_adamw'), so it is on the same scale as train.lr.")
    lr_schedule: Literal["cosine", "wsd"] = Field(
        "wsd", description="After warm-up: 'cosine' decays to min_lr over the whole run; 'wsd' "
        "(warmup-stable-decay, trapezoid) holds the peak, then decays linearly to min_lr over the last "
        "cooldown_fraction of the run.")
    cooldown_fraction: float = Field(0.4, gt=0.0, le=1.0, description="lr_schedule=wsd: share of the steps spent "
                                     "in the final linear decay.")
    zero_init_residual: bool = Field(
        True, description="Start each block's output projections (attention wo, MLP down) at zero, so every "
        "block begins as the identity (nanoGPT speedrun). Init only: the architecture stays Llama's.")
    weight_decay: float = Field(0.1, ge=0, description="Weight decay on matrices (AdamW's and Muon's).")
    betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1).")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0 = off).")
    max_tokens: int | None = Field(None, gt=0, description="Stop after this many training tokens.")
    max_steps: int | None = Field(None, gt=0, description="Stop after this many optimizer steps.")
    max_minutes: float | None = Field(5.0, gt=0, description="Stop after this many wall-clock minutes.")
    eval_interval: int = Field(50, gt=0, description="Validate every this many steps.")
    eval_batches: int = Field(8, gt=0, description="Fixed validation batches per evaluation.")
    checkpoint_every_steps: int = Field(100, gt=0, description="Checkpoint every this many steps.")
    checkpoint_every_minutes: float = Field(5.0, gt=0, description="...and at least this often in minutes.")
    seed: int = Field(1337, description="Seed for initialisation and data order.")
    threads: int = Field(0, ge=0, description="Intra-op threads per process (0 = the cores available).")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="'auto' times a few training steps in fp32 and under bf16 autocast on this CPU and keeps "
        "the faster (bf16 is not timed where the CPU lacks native bf16); cached per CPU, threads, model and batch."
    )
    activation_checkpointing: bool = Field(False, description="Recompute activations to save memory.")
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile the model's forward. 'auto' compiles where it pays: a child process "
        "compiles and times this training step and is stopped after 20% of the budget (at most 5 minutes), which "
        "the budget pays; compiled steps must be >= 1.1x faster. Cached per CPU, threads, model, batch and "
        "precision; compiled graphs are kept in the work folder. Budgets under 2.5 minutes, step/token budgets "
        "of unknown duration and multi-process runs stay eager.")
    nproc_per_node: int = Field(1, gt=0, description="Training processes on this machine (torchrun).")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="With several processes: 'ddp' (a full replica each, gradients averaged) or 'fsdp' "
        "(parameters, gradients and optimizer state sharded across them, for models whose training state does "
        "not fit one machine). Checkpoints load under either.")
    nnodes: int = Field(1, gt=0, description="Machines taking part (torchrun).")
    rdzv_endpoint: NonBlank = Field("127.0.0.1:29500", description="torchrun rendezvous host:port.")
    max_restarts: int = Field(3, ge=0, description="torchrun restarts of the worker group after a worker dies; "
                              "training resumes from its last checkpoint (with several processes).")
    init_from: NonBlank | None = Field(
        None,
        description="Continue from these pretrained weights instead of starting from scratch: 'champion' (the "
        "weights behind the registered champion; from scratch while there is none), a model folder, "
        "runs:/RUN_ID/model, or hf:DIR_OR_ID (a transformers Llama checkpoint: a folder, or a Hub id downloaded "
        "once). Their tokenizer is used; model.* must match cpuforge's own weights, and a transformers "
        "checkpoint's shape is taken as it is (its context capped at model.block_size).",
    )

    def optimizer_in_use(self) -> Literal["adamw", "muon"]:
        if self.optimizer == "auto":
            return "adamw" if self.strategy == "fsdp" else "muon"
        return self.optimizer

    def shards_matrices(self) -> bool:
        """FSDP over several processes: each holds a slice of every weight matrix, which Muon cannot update."""
        return self.strategy == "fsdp" and self.nproc_per_node * self.nnodes > 1

    @model_validator(mode="after")
    def _has_a_budget(self) -> TrainConfig:
        if self.max_tokens is None and self.max_steps is None and self.max_minutes is None:
            raise ValueError("train needs a budget: set max_tokens, max_steps or max_minutes")
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr={self.min_lr} is above train.lr={self.lr}")
        if self.optimizer == "muon" and self.shards_matrices():
            # Newton-Schulz orthogonalises the whole matrix; an FSDP rank holds only a slice of it.
            raise ValueError("train.optimizer=muon cannot run with train.strategy=fsdp: Muon needs each full "
                             "weight matrix, FSDP gives a process a shard; use train.strategy=ddp or "
                             "train.optimizer=adamw")
        return self


class PruneConfig(Section):
    keep_ratio: float = Field(0.5, gt=0.0, le=1.0, description="Fraction of parameters to keep, in (0, 1].")
    strategy: Literal["width", "depth", "width_then_depth"] = Field(
        "width", description="How the parameter cut is split across dimensions."
    )
    n_layer: int | None = Field(None, gt=0, description="Explicit target layers (overrides keep_ratio for depth).")
    n_head: int | None = Field(None, gt=0, description="Explicit target query heads.")
    n_kv_head: int | None = Field(None, gt=0, description="Explicit target KV heads.")
    d_model: int | None = Field(None, gt=0, description="Explicit target embedding width.")
    d_mlp: int | None = Field(None, gt=0, description="Explicit target MLP width.")
    width_multiple: int = Field(32, gt=0, description="keep_ratio's d_model and d_mlp are multiples of this (the MLP "
                                "takes what the budget leaves). 32 puts every row in whole blocks of the gguf stage's "
                                "Q8_0 and Q4_0, which a run that makes GGUF files needs; 8 is a finer grid for runs "
                                "that stop before it (--stop-after quantize): -1.1% bits per byte after recovery on a "
                                "1.26M model (benchmarks/prune_widths.py).")
    calib_batches: int = Field(16, gt=0, description="Train-split batches used to score importance.")
    batch_size: int = Field(8, gt=0, description="Sequences per calibration and validation batch.")
    val_batches: int = Field(8, gt=0, description="Validation batches for bits per byte before and after pruning.")
    seed: int = Field(11_344, description="Seed of the calibration batches (apart from training's data order).")

    def block_misfits(self, block: int) -> list[str]:
        """The settings that would leave pruned widths that rows of `block` values do not divide: the explicit
        widths where any dimension is explicit (they override width_multiple), else width_multiple."""
        explicit = [k for k in ("n_layer", "n_head", "n_kv_head", "d_model", "d_mlp") if getattr(self, k)]
        if explicit:
            return [f"prune.{k}={getattr(self, k)}" for k in ("d_model", "d_mlp") if getattr(self, k) and getattr(self, k) % block]
        return [f"prune.width_multiple={self.width_multiple}"] if self.width_multiple % block else []


class RecoverConfig(Section):
    max_tokens: int | None = Field(None, gt=0, description="Distillation budget in tokens.")
    max_steps: int | None = Field(None, gt=0, description="Distillation budget in optimizer steps.")
    max_minutes: float | None = Field(2.0, gt=0, description="Distillation budget in wall-clock minutes.")
    lr: float = Field(5e-4, gt=0, description="Peak learning rate.")
    temperature: float = Field(1.0, gt=0, description="Softmax temperature of the KL term.")
    kd_weight: float = Field(1.0, ge=0, description="Weight of forward KL(teacher || student).")
    lm_weight: float = Field(0.5, ge=0, description="Weight of the next-token LM loss.")
    optimizer: Literal["auto", "adamw", "muon"] = Field(
        "adamw", description="'adamw' (default) for every parameter at recover.lr; 'muon': Muon for the blocks' "
        "matrices at recover.muon_lr and AdamW at recover.lr for the embedding/LM head and norms, as "
        "train.optimizer=muon; 'auto' (the demo profile's): muon, except adamw with train.strategy=fsdp over "
        "several processes (Muon needs whole matrices). On demo runs Muon recovered several times closer to the "
        "teacher in the same steps (docs/training.md).")
    muon_lr: float = Field(2e-3, gt=0, description="Muon's peak learning rate when recover.optimizer=muon.")

    def optimizer_in_use(self, train: TrainConfig) -> Literal["adamw", "muon"]:
        if self.optimizer == "auto":
            return "adamw" if train.shards_matrices() else "muon"
        return self.optimizer

    @model_validator(mode="after")
    def _has_a_budget(self) -> RecoverConfig:
        if self.max_tokens is None and self.max_steps is None and self.max_minutes is None:
            raise ValueError("recover needs a budget: set max_tokens, max_steps or max_minutes")
        if self.kd_weight == 0 and self.lm_weight == 0:
            raise ValueError("recover.kd_weight and recover.lm_weight are both 0: nothing to train on")
        return self


class ExportConfig(Section):
    # torch.onnx's dynamo exporter only: the deprecated TorchScript one cannot export aten::rms_norm.
    opset: int = Field(
        23, ge=18, description="ONNX opset. 23 has native RMSNormalization and Attention ops (fewer, faster "
        "nodes in onnxruntime); 18-22 decompose them.")
    parity_atol: float = Field(1e-3, gt=0, description="Fail when ONNX and PyTorch logits differ by more.")


class QuantizeConfig(Section):
    method: Literal["best", "dynamic", "static", "genai"] = Field(
        "best", description="'best' tries dynamic and static int8 and ONNX Runtime GenAI's fused weight-only int8/int4 "
        "graphs (int4 with round-to-nearest or k-quant scales) and GPTQ int4, and keeps the fastest that passes the "
        "quality gates; the others try one family."
    )
    weight_type: Literal["auto", "qint8", "quint8"] = Field(
        "auto", description="Dynamic weight type; 'auto' picks what is accurate on this CPU."
    )
    calib_batches: int = Field(8, gt=0, description="Train-split batches for static calibration.")
    max_bpb_increase: float = Field(
        0.01, ge=0, description="Only int8 variants whose bits per byte is at most this fraction above the fp32 "
        "ONNX model's compete on speed (prefill and decode, see tasks/stages/quantize.py); if none is, keep the most accurate.")
    min_token_agreement: float = Field(
        0.97, ge=0, le=1, description="...and whose greedy next-token choice agrees with the fp32 ONNX model's on at "
        "least this fraction of the scored tokens where fp32 is confident (its top choice has probability >= 0.5; "
        "elsewhere near-ties flip with any rounding).")
    score_tokens: int = Field(16_384, gt=0, description="Val tokens each quantized candidate is scored on.")
    speed_seconds: float | None = Field(
        None, gt=0, description="Wall-clock cap on the candidates' timing rounds (warm-up included): after the "
        "minimum rounds, no round starts that would end past it, and a decision the noise has not settled by then "
        "says so. null: rounds go on until settled (at most 12). budget.minutes sets it to 5% of the budget.")
    build_seconds: float | None = Field(
        None, gt=0, description="Wall-clock cap on building and scoring the candidates, most likely winners first "
        "(the builder's int8 in blocks of 64, its k-quant int4 with an int8 head, dynamic int8, then the rest): the first is always built, and no "
        "other starts that would end past the cap at the pace of the slowest built so far; those left are listed "
        "as not built. null: every candidate. budget.minutes sets it to 5% of the budget.")
    favour: Literal["balanced", "decode", "prefill"] = Field(
        "balanced", description="What the fastest candidate is fastest at: 'balanced' ranks by the geometric mean of "
        "its prefill and decode speed-ups over fp32; 'decode' (a model that mostly generates) or 'prefill' (one that "
        "mostly reads: scoring, classification) by that one alone. A candidate that decodes slower than fp32 never wins.")


class EvalConfig(Section):
    max_tokens: int = Field(65_536, gt=0, description="Val tokens every variant is scored on.")
    batch_sizes: list[int] = Field([1, 8], min_length=1, description="Batch sizes for prefill speed (full context).")
    decode_tokens: int = Field(64, gt=0, description="Tokens generated to time decoding.")
    prompts: list[Annotated[str, Field(min_length=1)]] = Field(
        [], description="Fixed prompts for samples; empty (the default): the opening words of three validation "
        "documents, so the samples are in the corpus' own language.")
    max_new_tokens: int = Field(80, gt=0, description="Length of each sample.")
    speed_seconds: float | None = Field(
        None, gt=0, description="Wall-clock cap on timing every variant's speed (warm-up included): after 2 rounds, "
        "no round starts that would end past it. null: 5 rounds whatever they take. budget.minutes sets it to 5% of "
        "the budget.")


    @model_validator(mode="after")
    def _positive_batches(self) -> EvalConfig:
        if any(b <= 0 for b in self.batch_sizes):
            raise ValueError(f"eval.batch_sizes must be positive, got {self.batch_sizes}")
        return self


class TrackingConfig(Section):
    uri: NonBlank | None = Field(
        None, description="MLflow tracking URI; default $MLFLOW_TRACKING_URI, else sqlite:///<workdir>/mlflow.db."
    )
    experiment: NonBlank = Field("cpuforge", description="MLflow experiment (one per project).")
    registered_model: NonBlank = Field("cpuforge-lm", description="Name in the MLflow model registry.")
    system_metrics: bool = Field(True, description="Log CPU/memory system metrics for each stage.")


class BudgetConfig(Section):
    minutes: float | None = Field(
        None, gt=0, description="The whole job's wall-clock target in minutes (the hour and overnight profiles). Set, "
        "it plans train.max_minutes and recover.max_minutes for the model at hand (replacing the profile's and "
        "yours): the stages that train nothing are estimated from its size, and what is left trains, "
        "pretrain_share of it pretraining in `run`, all of it recovering in `compress`. The plan is logged when the "
        "run starts; null leaves the stages' own minutes.")
    pretrain_share: float = Field(0.6, gt=0, lt=1, description="`run` with budget.minutes: pretraining's share of "
                                  "the training time; recovery has the rest.")


class Config(Section):
    profile: str = DEFAULT_PROFILE
    budget: BudgetConfig = BudgetConfig()
    data: DataConfig = DataConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()  # type: ignore[valid-type]
    train: TrainConfig = TrainConfig()
    prune: PruneConfig = PruneConfig()
    recover: RecoverConfig = RecoverConfig()
    export: ExportConfig = ExportConfig()
    quantize: QuantizeConfig = QuantizeConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _recover_can_shard(self) -> Config:
        if self.recover.optimizer == "muon" and self.train.shards_matrices():
            raise ValueError("recover.optimizer=muon cannot run with train.strategy=fsdp: Muon needs each full "
                             "weight matrix, FSDP gives a process a shard; use train.strategy=ddp or "
                             "recover.optimizer=adamw")
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


SECTIONS: dict[str, type[Section]] = {
    name: field.annotation  # type: ignore[misc]
    for name, field in Config.model_fields.items()
    if name != "profile"
}


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def load_config(
    profile: str | None = None,
    config_file: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> Config:
    """Resolve and validate the configuration, or raise ConfigError naming what is wrong."""
    file_values: dict[str, Any] = _read_yaml(Path(config_file)) if config_file else {}
    profile = profile or file_values.pop("profile", None) or DEFAULT_PROFILE
    file_values.pop("profile", None)
    if profile not in available_profiles():
        raise ConfigError(f"unknown profile {profile!r}; available: {', '.join(available_profiles())}")

    values = _read_yaml(PROFILES_DIR / f"{profile}.yaml")
    _check_keys(file_values, origin=str(config_file))
    _deep_merge(values, file_values)
    for item in overrides:
        section, key, value = _parse_override(item)
        values.setdefault(section, {})[key] = value
    values["profile"] = profile
    try:
        return Config.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path} ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, not {type(data).__name__}")
    return data


def _check_keys(values: dict[str, Any], origin: str) -> None:
    for section, body in values.items():
        if section not in SECTIONS:
            raise ConfigError(f"{origin}: {_unknown('section', section, SECTIONS)}")
        if not isinstance(body, dict):
            raise ConfigError(f"{origin}: section {section!r} must be a mapping of keys")
        for key in body:
            if key not in SECTIONS[section].model_fields:
                raise ConfigError(f"{origin}: {_unknown('key', f'{section}.{key}', SECTIONS[section].model_fields, section)}")


def _parse_override(item: str) -> tuple[str, str, Any]:
    dotted, sep, raw = item.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not sep or not dot or not key:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.max_minutes=10")
    if section not in SECTIONS:
        raise ConfigError(f"--set {item!r}: {_unknown('section', section, SECTIONS)}")
    if key not in SECTIONS[section].model_fields:
        raise ConfigError(f"--set {item!r}: {_unknown('key', dotted, SECTIONS[section].model_fields, section)}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # not YAML: take the text as it is
    return section, key, value


def _unknown(kind: str, name: str, allowed: Any, section: str | None = None) -> str:
    names = sorted(allowed)
    short = name.split(".")[-1]
    close = difflib.get_close_matches(short, names, n=1)
    hint = f" (did you mean {(section + '.') if section else ''}{close[0]}?)" if close else ""
    prefix = f"{section}." if section else ""
    return f"unknown {kind} {name!r}{hint}; allowed: {', '.join(prefix + n for n in names)}"


def _describe(exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        message = err["msg"].removeprefix("Value error, ")
        got = err.get("input")
        shown = f" (got {got!r})" if where and not isinstance(got, dict) else ""
        if not where or message.startswith(f"{where}."):  # the message already names the key
            problems.append(message)
        else:
            problems.append(f"{where}: {message}{shown}")
    return "invalid configuration: " + "; ".join(problems)


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value
