"""torchrun entry point: `python -m torch.distributed.run ... -m cpuforge.tasks.engine.distributed launch.json`.

Each process joins the gloo process group and runs the same training as a single process
would; DDP averages gradients, rank 0 logs, checkpoints and writes the outputs.
"""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

from cpuforge.tasks.engine.training_run import TrainingSpec, run_training


def main(spec_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(asctime)s %(name)s: %(message)s")
    try:
        with open(spec_path) as f:
            run_training(TrainingSpec.model_validate_json(f.read()))
        # Rank 0 still writes the outputs when the others return. A rank that tears its gloo pairs
        # down meanwhile can abort in teardown ("terminate called without an active exception"),
        # which torchrun counts as a failure and restarts the group for: leave together.
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
