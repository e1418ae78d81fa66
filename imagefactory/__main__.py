"""`python -m imagefactory` and the `imagefactory` command: a help page typer printed before is
replayed without importing the CLI (helpcache.py); everything else runs cli.main."""

import sys


def main() -> None:
    from imagefactory.cli import helpcache

    if helpcache.replay(sys.argv[1:]):
        return
    from imagefactory.cli import app as cli

    cli.main()


if __name__ == "__main__":
    main()
