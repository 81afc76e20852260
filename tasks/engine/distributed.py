"""torchrun entry point: `python -m torch.distributed.run ... -m cpuforge.tasks.engine.distributed launch.json`.

Each process joins the gloo process group and runs the same training as a single process
would; DDP averages gradients, rank 0 logs, checkpoints and writes the outputs.
"""

from __future__ import annotations

import logging
import os
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
        dist.barrier()  # rank 0 still writes the outputs when the others return: leave together
    except BaseException:
        dist.destroy_process_group()
        raise
    # Done, outputs written. Exit without gloo's C++ teardown: even after the barrier a rank could abort
    # in it ("terminate called without an active exception", SIGABRT; seen in CI), which torchrun counts
    # as a failure and answers by restarting the group, which trains again from the last checkpoint.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
