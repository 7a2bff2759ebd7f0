"""python -m fsdp_trainer --config <file | json | s3://...> [--section.field value ...]"""

from __future__ import annotations

import logging
import os
import sys

from pydantic import ValidationError

from fsdp_trainer import access, cli
from fsdp_trainer.contract import ErrorKind
from fsdp_trainer.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = cli.build_parser()
    args = parser.parse_args(argv)
    try:
        config = cli.resolve_config(args)
    except (ValidationError, ConfigError, OSError, ValueError) as error:
        print(f"invalid configuration (error kind config): {error}", file=sys.stderr)
        return 2
    submission_id = cli.submission_id(args)
    try:
        cli.check(config)
    except ConfigError as error:
        # The schema held, so the run's storage is known: tell the operator there, too.
        from fsdp_trainer.driver import record_failure

        print(f"invalid configuration (error kind config): {error}", file=sys.stderr)
        record_failure(config, f"ConfigError: {error}", ErrorKind.CONFIG, submission_id)
        return 2
    if args.print_config:
        print(config.to_json())
        return 0
    try:
        access.check_storage_access(config)
    except access.StorageAccessRefused as refused:
        print(f"storage access refused (error kind {ErrorKind.STORAGE_ACCESS}): {refused}", file=sys.stderr)
        return 2
    direct = args.launcher == "direct" or (args.launcher == "auto" and "TORCHELASTIC_RUN_ID" in os.environ)
    if direct:
        from fsdp_trainer.launch import LoopInput
        from fsdp_trainer.loop import train_loop

        loop_input = LoopInput(trainer=config, submission_id=submission_id, attempt=args.attempt_info)
        train_loop(loop_input.model_dump(mode="json"))
        return 0
    from fsdp_trainer.driver import run_with_ray
    from fsdp_trainer.runlog import install_redaction

    install_redaction(config.secret_env_names)  # the driver's output is the job's log
    return run_with_ray(config, submission_id, args.attempt_info)


if __name__ == "__main__":
    sys.exit(main())
