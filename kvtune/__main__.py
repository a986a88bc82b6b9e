from kvtune.cli import main

if __name__ == "__main__":  # not when a worker process of `--workers` re-imports the main module
    main()
