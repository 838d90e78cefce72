from ortune.cli.app import main

main()
