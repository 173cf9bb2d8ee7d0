"""Allow ``python -m kandevd``."""

from kandevd.cli import main

if __name__ == "__main__":  # pragma: no cover - thin entry point
    main()
