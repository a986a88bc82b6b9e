from kvtune.cli import main

main()
