from tieredkv.cli import main

main()
