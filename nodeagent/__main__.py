"""``python -m nodeagent``: the same as ``gpu-nodeagent``."""

import sys

from nodeagent.cli import main

sys.exit(main())
