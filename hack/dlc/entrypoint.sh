#!/bin/bash
# The stand-in's /usr/local/bin/entrypoint.sh, where the Ray Train DLC has its own: the DLC's runs its CUDA
# forward-compatibility step (for a host driver older than the image's CUDA), then execs its arguments. Here
# there is no GPU: it says that it ran (the tests look for this line in the Ray pods' logs), then execs them.
echo "dlc-entrypoint: CUDA compatibility step (stand-in: no GPU on this node)"
exec "$@"
