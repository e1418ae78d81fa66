"""`python -m imagefactory` and the `imagefactory` command: cli.main. The CLI imports typer and
its own option declarations only; each command imports its pipeline steps when it runs, so
`--help` is fast from lazy imports alone (tests/unit/cli/test_imports.py)."""


def main() -> None:
    from imagefactory.cli import app

    app.main()


if __name__ == "__main__":
    main()
