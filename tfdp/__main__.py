"""`python -m tfdp` and the `tfdp` command: TCMalloc first (`tfdp.startup.allocator`), then the command line."""


def main() -> None:
    from tfdp.startup import allocator
    allocator.preload_tcmalloc()
    from tfdp.cli import run
    run()


if __name__ == "__main__":
    main()
