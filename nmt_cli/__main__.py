from nmt_cli.cli.main import main

main()
