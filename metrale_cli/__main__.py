from metrale_cli.cli.app import main

main()
