from rlmctl.cli import main

main()
