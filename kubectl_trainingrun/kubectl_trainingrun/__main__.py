"""python -m kubectl_trainingrun ARGS: what `kubectl trainingrun ARGS` runs."""

import sys

from kubectl_trainingrun.cli import main

sys.exit(main())
