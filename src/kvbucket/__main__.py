from kvbucket.cli import main

main()
