from tfdp.cli import run

run()
