"""`python -m flatshard ...`: the command line (see flatshard/cli/main.py)."""

import sys

from flatshard.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
