"""`python -m skvs_jax.commands` is the `skvs` command."""

import sys

from skvs_jax.commands import main

sys.exit(main())
