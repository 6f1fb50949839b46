import argparse
import sys
from pathlib import Path

from pipeline.core.errors import ConfigError
from scripts.platforms import __doc__ as DOC
from scripts.platforms.render import EXAMPLE, OUT, generate, write
from scripts.platforms.values import load_values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=DOC.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--values", type=Path, default=EXAMPLE, help=f"default: {EXAMPLE.name}")
    parser.add_argument("--out", type=Path, default=OUT, help="default: platforms/")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="over the values")
    args = parser.parse_args(argv)
    try:
        files = generate(load_values(args.values, args.overrides))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write(args.out, files)
    print(f"{len(files)} files under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
