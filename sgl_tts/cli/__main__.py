"""`python -m sgl_tts.cli ...`: the `sgl-tts` command without its console script."""

import sys

from sgl_tts.cli import main

sys.exit(main())
