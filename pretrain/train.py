"""Entry point: load config -> build Trainer -> train -> close.

    pretrain-train configs/quickstart.yaml optim.lr=3e-4 train.max_steps=100
    torchrun --nproc-per-node 2 -m pretrain.train configs/recipes/clear_del_span_reorder.yaml run_dir=runs/x
    pretrain-train --check runs/x      (every checkpoint: good or damaged, and why)
    pretrain-train configs/recipes/clear_del_span.yaml model=tiny --dry-run --ranks 64   (banner + memory, exit)
"""

from __future__ import annotations

import argparse
import os
import sys

# The package is imported inside the functions below, not here: `pretrain-train --help` and bad arguments answer in
# ~0.3 s instead of the ~6 s that torch and the trainer take to import (python -X importtime) on every rank.


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pretrain-train", description=__doc__.splitlines()[0],
                                epilog="pretrain-train --check RUN_DIR lists every checkpoint of a run as good or "
                                       "damaged (sizes + whole-file sha256) and the one a resume would use")
    p.add_argument("config", nargs="?", help="YAML config (see configs/); omitted = defaults")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 model.norm=pre; "
                                                "model=tiny|mini|small|base|large picks a size preset; "
                                                "include=FILE merges a YAML file")
    p.add_argument("--dry-run", action="store_true",
                   help="resolve the config, build the model and the data, print the banner and the per-rank "
                        "memory estimate, and exit without training or writing a checkpoint")
    p.add_argument("--verbose", action="store_true",
                   help="let DeepSpeed's and other libraries' messages through to the console (off by default)")
    p.add_argument("--ranks", type=int, default=0,
                   help="with --dry-run: the number of data-parallel ranks to plan for (default: this launch's)")
    args = p.parse_intermixed_args(argv)
    if args.config and "=" in args.config and not os.path.exists(args.config):
        args.overrides.insert(0, args.config)
        args.config = None
    return args


def check(run_dir: str, *, full: bool = True) -> int:
    """``pretrain-train --check RUN_DIR``: every checkpoint of a run, good or damaged and why; 1 when the newest
    is damaged (a resume would fall back), 0 otherwise."""
    from pathlib import Path

    from pretrain.checkpoint import store

    ckpt_dir = store.checkpoints_dir(run_dir)
    if not Path(run_dir).is_dir():
        print(f"pretrain-train: error: {run_dir} is not a directory", file=sys.stderr)
        return 2
    tags = store.list_complete(ckpt_dir)
    if not tags:
        print(f"{ckpt_dir}: no complete checkpoint")
        return 0
    how = "sizes + whole-file sha256" if full else "sizes + sampled sha256"
    print(f"{ckpt_dir} ({how}; resume checks sizes + sampled sha256):")
    bad = {}
    for tag in tags:
        problems = store.verify_checkpoint(ckpt_dir / tag, full=full)
        unrecorded = not (ckpt_dir / tag / store.FILES_FILE).is_file()
        verdict = "damaged: " + "; ".join(problems) if problems else (
            "good (written before file checksums were recorded: state file only)" if unrecorded else "good")
        print(f"  {tag}  {verdict}")
        bad[tag] = bool(problems)
    resumable = store.find_resumable(ckpt_dir, say=lambda _: None)
    print(f"a resume would start from: {resumable or 'nothing (no intact checkpoint)'}")
    return 1 if bad[tags[-1]] else 0


def dry_run(cfg, env, ranks: int = 0) -> int:
    """``--dry-run``: everything the trainer checks and builds before DeepSpeed starts, then the banner."""
    from pretrain.training.banner import banner_lines, check_plan_fits
    from pretrain.training.build import prepare_run

    parts = prepare_run(cfg, env)
    for line in banner_lines(parts.cfg, ranks or env.world_size, parts.module, parts.train_set, parts.valid_set):
        print(line)
    check_plan_fits(parts.cfg, parts.module, ranks or env.world_size, env)  # ValueError naming the estimate and what to change
    print(f"dry run: config, tokenizer, data and model are fine; nothing was trained or written to {cfg.run_dir}. "
          f"Drop --dry-run to train.")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--check"]:
        if len(argv) != 2:
            print("usage: pretrain-train --check RUN_DIR", file=sys.stderr)
            return 2
        return check(argv[1])
    args = parse_args(argv)
    from pretrain.config import load_run_config
    from pretrain.config.lint import missing_paths
    from pretrain.console import set_verbose
    from pretrain.distributed.env import detect_env
    from pretrain.training.resume import run_precision

    set_verbose(args.verbose)
    try:
        cfg = load_run_config(args.config, args.overrides, run_precision=run_precision)
    except (ValueError, FileNotFoundError) as e:
        print(f"pretrain-train: error: {e}", file=sys.stderr)
        return 2
    missing = missing_paths(cfg)  # an empty data path named by its key, before anything is built
    if missing:
        print(f"pretrain-train: error: {'; '.join(missing)}", file=sys.stderr)
        return 2
    env = detect_env()
    if args.dry_run:
        from pretrain.checkpoint.store import CheckpointError

        try:
            return dry_run(cfg, env, args.ranks)
        except (ValueError, FileNotFoundError) as e:
            print(f"pretrain-train: error: {e}", file=sys.stderr)
            return 2
        except CheckpointError as e:  # a damaged checkpoint.init_from: the exit code a real run gives (train)
            print(f"pretrain-train: error: {e}", file=sys.stderr)
            return 4
    return train(cfg, env)


def agree_on_precision(cfg, env):
    """``cfg`` with rank 0's ``train.precision`` on every rank: each rank resolves ``auto`` on its own machine, and
    one job can span nodes of different kinds (CPUs with and without AMX-BF16, GPUs with and without bf16), where
    DeepSpeed would otherwise be configured differently per rank; explicit values are the same on every rank
    already. A rank whose own resolution differs says so. Collective (after ``init_process_group``)."""
    import dataclasses

    import torch

    if not env.is_distributed:
        return cfg
    box = [cfg.train.precision]
    torch.distributed.broadcast_object_list(box, src=0)
    if box[0] == cfg.train.precision:
        return cfg
    print(f"rank {env.rank}: train.precision={box[0]} as rank 0 resolved it (this rank's machine resolved "
          f"{cfg.train.precision}): the job spans nodes of different kinds", file=sys.stderr, flush=True)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=box[0]))


def train(cfg, env) -> int:
    """Trains ``cfg`` in this process (one rank of ``env``); the exit code: 0 done, 2 bad config or input,
    3 diverged, 4 checkpoint not writable/readable or metrics not writable (after a checkpoint), 5 the data
    loader's workers died or stalled, 69 another rank or node is gone, 75 stopped for a requeue, 130 Ctrl-C."""
    from pretrain.checkpoint.store import CheckpointError
    from pretrain.data.workers import DATA_WORKER_EXIT_CODE, DataWorkerError
    from pretrain.distributed.env import destroy_process_group, init_process_group
    from pretrain.distributed.signals import StopSignal
    from pretrain.metrics.writer import MetricsWriteError
    from pretrain.training.progress import TrainingDiverged
    from pretrain.training.trainer import Trainer

    init_process_group(env, backend=cfg.distributed.backend, timeout_s=cfg.distributed.timeout_s)
    cfg = agree_on_precision(cfg, env)
    stop = StopSignal()
    trainer = None
    try:
        trainer = Trainer(cfg, env, stop_signal=stop)
        return trainer.train()
    except (ValueError, FileNotFoundError) as e:
        print(f"pretrain-train: error (rank {env.rank}): {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"pretrain-train: {e}", file=sys.stderr)
        return 3
    except DataWorkerError as e:
        print(f"pretrain-train: error (rank {env.rank}): {e}", file=sys.stderr)
        return DATA_WORKER_EXIT_CODE
    except KeyboardInterrupt:  # a second Ctrl-C (StopSignal turns the first into a checkpoint-and-stop)
        step, published = trainer.abandon_save() if trainer is not None else (None, None)
        if published is not None:
            saved = f"checkpoint {published} had been published before it"
        elif not env.is_main and step is not None:
            saved = f"the save of step {step} in flight was abandoned (rank 0 says whether it had been published)"
        else:
            saved = "nothing was saved since the last checkpoint" + (
                f" (the save of step {step} being written was removed)" if step is not None else "")
        print(f"pretrain-train: aborted by a second SIGINT (rank {env.rank}); {saved}", file=sys.stderr)
        return 130
    except (CheckpointError, MetricsWriteError) as e:  # disk full or unreadable checkpoint: the message says what to do
        code = _peer_lost(e, env, cfg)  # or a save that failed because a rank is gone: the job's end, not the disk's
        if code is None:
            print(f"pretrain-train: error (rank {env.rank}): {e}", file=sys.stderr)
        return 4 if code is None else code
    except Exception as e:
        code = _peer_lost(e, env, cfg)
        if code is None:
            raise
        return code
    finally:
        if trainer is not None:
            stop.closing(trainer.cancel_save)  # a Ctrl-C from here on does not cut the close short
            trainer.close()
        stop.uninstall()
        destroy_process_group()

def _peer_lost(error: BaseException, env, cfg) -> int | None:
    """When ``error`` says a collective failed because another rank is gone (``peers.peer_gone``): one line saying so
    and what to resume from, not the collective's traceback (shown with --verbose), and NODE_LOST_EXIT_CODE, as for a
    lost node; else None (nothing printed)."""
    import traceback
    from pathlib import Path

    from pretrain.checkpoint.store import CheckpointError
    from pretrain.console import verbose
    from pretrain.distributed.peers import NODE_LOST_EXIT_CODE, peer_gone
    from pretrain.training.resume import last_good_checkpoint

    gone = peer_gone(error)
    if gone is None:
        return None
    if verbose():
        traceback.print_exception(error)
    saving = f"{error}; " if isinstance(error, CheckpointError) else ""
    print(f"pretrain-train: error (rank {env.rank}): another rank of the job is gone ({gone}); "
          f"{saving}stopping. {last_good_checkpoint(Path(cfg.run_dir))}: relaunch the job to resume from it (its "
          f"log says why that rank ended: the OOM killer, a crash, a signal).", file=sys.stderr)
    return NODE_LOST_EXIT_CODE


def cli() -> None:
    """``pretrain-train`` and ``python -m pretrain.train``: ``main``'s exit code, without the interpreter's teardown.

    By the time ``main`` returns, the trainer has closed everything it opened (checkpoint writer joined, loader
    workers stopped, metrics and TensorBoard files closed, lock released, process group destroyed). What remains is
    CPython's finalization, and in a distributed process that is where c10d's C++ threads can still reach for the
    GIL: a rare ``terminate called without an active exception`` (SIGABRT, seen once in CI on a 2-rank run that had
    printed "done" and published its checkpoint) turns a finished run into a failed job, which torchrun and sbatch
    then report as a failure and Slurm may requeue. So the streams are flushed and the process ends here. An
    exception out of ``main`` still takes the normal path (traceback, exit 1)."""
    import logging

    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said on it
            pass
    os._exit(int(code or 0))


if __name__ == "__main__":
    cli()
