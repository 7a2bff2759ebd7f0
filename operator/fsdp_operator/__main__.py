"""`python -m fsdp_operator`: run the operator with settings from FSDP_OPERATOR_* variables or flags."""

from __future__ import annotations

import asyncio
import logging
import sys

import kopf
from pydantic import ValidationError
from pydantic_settings import CliApp

from fsdp_operator.handlers import register
from fsdp_operator.settings import Settings


def main(argv: list[str] | None = None) -> None:
    try:
        settings = CliApp.run(Settings, cli_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as error:
        sys.exit(f"fsdp-operator: invalid settings:\n{error}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # per-handler success lines every interval
    registry = kopf.OperatorRegistry()
    register(registry, settings)
    asyncio.run(
        kopf.operator(
            registry=registry,
            standalone=True,
            clusterwide=not settings.watch_namespaces,
            namespaces=settings.watch_namespaces,
        )
    )


if __name__ == "__main__":
    main()
