"""One resolution of what a run is asked to do: profile, config file, overrides, work folder and the
weights it starts from, to the validated Config and the facts worked out from it. `cpuforge run`,
`compress`, `plan` and the Prefect flows (flows/session.py) all go through `resolve_run`, so each
fact is worked out in one place and once per resolution.

Two steps, because the weights a run starts from are only found once the run has started (an MLflow
lookup or a download, as a Prefect task): `resolve_run` before, `ResolvedRun.start` after.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpuforge.models.fileio import sha256_file
from cpuforge.tasks import stages
from cpuforge.tasks.config.settings import Config, load_config
from cpuforge.tasks.infra import confinement
from cpuforge.tasks.infra.stage import StageSpec

if TYPE_CHECKING:
    from cpuforge.tasks.release.lineage import PretrainedSource

HF_PREFIX = "hf:"

log = logging.getLogger("cpuforge.resolve")


@dataclass
class ResolvedRun:
    """The settings of one run and what follows from them. `cfg` is final once `start` has run."""

    cfg: Config
    workdir: Path
    pretrained: str = ""  # compress's source of weights ("champion", runs:/..., a folder, hf:...); "" for pipeline
    source: PretrainedSource | None = None  # the weights found for it when the run started

    @functools.cached_property
    def data_fingerprint(self) -> str:
        """The data source's fingerprint (lists its files): taken once, though the run and the
        pre-flight check both need it. Finding the weights never changes data.*, so it stays valid."""
        from cpuforge.tasks.data.corpus import source_fingerprint

        return source_fingerprint(self.cfg.data)

    def corpus_key(self) -> dict[str, str | None]:
        """The tokenize stage's extra key, as tasks/data/corpus.py stage_extra_key makes it. The tokenizer
        file is hashed from the current cfg: starting from weights brings their tokenizer."""
        tokenizer_hash = None
        if self.cfg.tokenizer.path:
            path = Path(self.cfg.tokenizer.path).expanduser()
            tokenizer_hash = sha256_file(path) if path.is_file() else "missing"
        return {"source": self.data_fingerprint, "tokenizer_file": tokenizer_hash}

    def extra_key(self, spec: StageSpec) -> Any:
        """What a stage's key holds besides config, inputs and code (tasks/stages/__init__.py extra_key),
        with the corpus' fingerprint taken once."""
        if spec.extra == "corpus":
            return self.corpus_key()
        return stages.extra_key(spec, self.cfg, self.source)

    def check_data(self) -> None:
        """A data source that cannot be read fails here, before any work."""
        self.corpus_key()

    def check_prune_target(self) -> None:
        """Reject an impossible pruning target before any work, estimating the vocabulary by
        tokenizer.vocab_size (the prune stage computes the real target from the model it prunes)."""
        if self.cfg.model.unresolved:  # model.size=auto: the shape is chosen when the run starts; prune checks it then
            return
        if (self.cfg.train.init_from or "").startswith(HF_PREFIX):  # a transformers checkpoint brings its own shape
            return
        from cpuforge.tasks.stages.prune import target_config

        target_config(self.cfg.model.shape(self.cfg.tokenizer.vocab_size), self.cfg.prune)

    def check_pretrained(self) -> None:
        """A local hf: checkpoint cpuforge cannot take (compress's --pretrained, or train.init_from) fails here,
        in a second, before Prefect starts."""
        named = self.pretrained or self.cfg.train.init_from or ""
        folder = Path(named.removeprefix(HF_PREFIX)).expanduser()
        if named.startswith(HF_PREFIX) and folder.is_dir():
            from cpuforge.tasks.release.lineage import check_hf_checkpoint

            check_hf_checkpoint(folder, named)

    def start(self, source: PretrainedSource | None, adopt_shape: bool = False) -> None:
        """Finish the resolution once the weights the run starts from are known (None: a new model):
        their tokenizer and shape, or for a new model the shape model.size=auto chooses. Before any
        stage key is computed: the keys hold the shape."""
        from cpuforge.tasks.config.budget import plan_budget
        from cpuforge.tasks.engine.sizing import resolve_auto_size
        from cpuforge.tasks.release.lineage import with_source

        compress = bool(self.pretrained)
        if source is not None:
            self.cfg = with_source(self.cfg, source, adopt_shape)
        else:
            self.cfg, _ = plan_budget(self.cfg, compress)  # auto sizes the model for pretraining's planned minutes
            self.cfg, _ = resolve_auto_size(self.cfg, self.workdir)
        self.cfg, plan = plan_budget(self.cfg, compress)  # again, for the model now known
        if plan is not None:
            log.info("%s", plan.describe())
        self.source = source


def resolve_run(profile: str | None, config_file: str | None, overrides: Sequence[str], workdir: str | Path,
                pretrained: str = "") -> ResolvedRun:
    """The validated settings: the profile, then the config file, then each override (later wins). On a
    confined worker every path they name must lie in the allowed folders (tasks/infra/confinement.py),
    the config file's before it is read."""
    confinement.check_config_file(config_file)
    cfg = load_config(profile or None, config_file or None, list(overrides))
    confinement.check_config(cfg)
    return ResolvedRun(cfg, Path(workdir).expanduser().resolve(), pretrained)

