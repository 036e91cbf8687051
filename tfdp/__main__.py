"""`python -m tfdp` and the `tfdp` command: TCMalloc first (`tfdp.allocator`), then the command line."""


def main() -> None:
    from tfdp import allocator
    allocator.preload_tcmalloc()
    from tfdp.cli import run
    run()


if __name__ == "__main__":
    main()
