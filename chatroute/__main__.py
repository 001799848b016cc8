"""`python -m chatroute`: the same command line as the `chatroute` script."""

from chatroute.cli import main

if __name__ == "__main__":
    main()
