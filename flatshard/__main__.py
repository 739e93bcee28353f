"""`python -m flatshard ...`: the command line (see flatshard/cli/main.py)."""

from flatshard.cli.main import entry

if __name__ == "__main__":
    entry()
