from oomguard.cli import main

main()
