from imagefactory.cli import main

main()
