from gradsvc.runtime.cli import main

main()
