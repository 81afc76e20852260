"""budget.minutes: one wall-clock target for the whole job, planned into the training stages' minutes for the
model at hand, and caps evaluate's and quantize's speed timing rounds at PROBE_SHARE of it each (and quantize's
candidate building at as much again). The stages that train nothing (adopt, prune, export, quantize, gguf,
evaluate, register) cost about in proportion to the parameters they handle, the model before pruning and after;
what is left trains. In `run`, budget.pretrain_share of it pretrains and the rest recovers; `compress` has no
pretraining, so all of it recovers.

The plan is made from the settings and the shape alone, never from a timing: the stage keys hold the minutes it
gives, so the same settings key the same stages on every run (a rerun after a crash reuses what finished).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from cpuforge.models.llama import config_param_count
from cpuforge.tasks.config.settings import Config
from cpuforge.tasks.records.errors import ConfigError

log = logging.getLogger("cpuforge.budget")

# The stages that train nothing, in seconds: a part whatever the model (Prefect and MLflow starting, the corpus
# tokenized, each stage's own start, quantize's candidates and evaluate's five variants at the profile's token
# counts, recovery's closing evaluation, registration) and a part per million parameters of the model before and
# after pruning. Set from `compress --profile hour` of a 134.5M model on a 2-core Xeon with AMX, where they and
# recovery's overrun of its minutes (its closing evaluation and save) took 20.5 of its 50 minutes, with a margin of
# about 5 minutes for a slower machine, and from a 1.1B -> 0.55B compress's adopt, prune and export
# (benchmarks/results/2026-12-06-real-size-compress.md): generous at 1B, where the cost grows more slowly than the
# parameters.
FIXED_S = 840.0
PER_MPARAM_S = 3.0
MIN_TRAIN_MINUTES = 1.0  # less than this trains nothing worth keeping
PROBE_SHARE = 0.05  # of the budget, at most, for each stage's timing rounds (evaluate's, quantize's)


@dataclass(frozen=True)
class BudgetPlan:
    minutes: float
    other_minutes: float  # the stages that train nothing, estimated
    pretrain_minutes: float | None  # None in compress
    recover_minutes: float
    params: int  # the model before pruning (0: its size is still to be chosen)
    pruned_params: int
    probe_seconds: float  # the cap budget.minutes puts on quantize's and evaluate's timing rounds, each

    def describe(self) -> str:
        size = f"{self.params / 1e6:.1f}M -> {self.pruned_params / 1e6:.1f}M parameters" if self.params else \
            "a model still to be sized"
        train = (f"pretrain {self.pretrain_minutes:.1f} min, recover {self.recover_minutes:.1f} min"
                 if self.pretrain_minutes is not None else f"recover {self.recover_minutes:.1f} min")
        return (f"budget.minutes={self.minutes:g} for {size}: {train}; the other stages about "
                f"{self.other_minutes:.1f} min ({FIXED_S / 60:.0f} min + {PER_MPARAM_S:g} s per million parameters "
                f"before and after pruning); speed timing rounds at most {self.probe_seconds:.0f} s each in quantize "
                "and evaluate, where not set by hand")


def _param_counts(cfg: Config) -> tuple[int, int]:
    """(the model's parameters, the pruned model's), or (0, 0) while model.size=auto has not chosen a shape."""
    if cfg.model.unresolved:
        return 0, 0
    from cpuforge.tasks.engine.sizing import planned_vocab_size
    from cpuforge.tasks.stages.prune import target_config

    shape = cfg.model.shape(planned_vocab_size(cfg))
    return config_param_count(shape), config_param_count(target_config(shape, cfg.prune))


def plan_budget(cfg: Config, compress: bool) -> tuple[Config, BudgetPlan | None]:
    """The config with train.max_minutes (in `run`) and recover.max_minutes planned from budget.minutes, and the
    plan; the config as it is and None without a budget."""
    b = cfg.budget
    if b.minutes is None:
        return cfg, None
    params, pruned = _param_counts(cfg)
    other = (FIXED_S + PER_MPARAM_S * (params + pruned) / 1e6) / 60
    training = b.minutes - other
    if training < MIN_TRAIN_MINUTES * (1 if compress else 2):
        size = f"{params / 1e6:.0f}M -> {pruned / 1e6:.0f}M parameters" if params else "any model"
        raise ConfigError(f"budget.minutes={b.minutes:g} leaves no time to train: the stages that train nothing take "
                          f"about {other:.0f} min for {size}; raise budget.minutes, or set budget.minutes=null and "
                          "train.max_minutes / recover.max_minutes")
    pretrain = None if compress else max(MIN_TRAIN_MINUTES, round(training * b.pretrain_share, 1))
    recover = max(MIN_TRAIN_MINUTES, round(training - (pretrain or 0), 1))
    # Speed timing rounds, a probe of sorts, get at most their share of the budget (unless set by hand).
    probe_s = round(b.minutes * 60 * PROBE_SHARE)
    plan = BudgetPlan(b.minutes, round(other, 1), pretrain, recover, params, pruned, probe_s)
    update: dict[str, Any] = {"recover": cfg.recover.model_copy(update={"max_minutes": recover})}
    if cfg.eval.speed_seconds is None:
        update["eval"] = cfg.eval.model_copy(update={"speed_seconds": probe_s})
    # Quantize's candidates get as much again to be built and scored: the stage stays near 10% of the budget.
    quantize_caps = {k: probe_s for k in ("speed_seconds", "build_seconds") if getattr(cfg.quantize, k) is None}
    if quantize_caps:
        update["quantize"] = cfg.quantize.model_copy(update=quantize_caps)
    if pretrain is not None:
        update["train"] = cfg.train.model_copy(update={"max_minutes": pretrain})
    return cfg.model_copy(update=update), plan
