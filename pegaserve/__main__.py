"""`python -m pegaserve --model DIR --port P`: the standalone server (pegaserve/standalone.py)."""

from pegaserve.standalone import main

if __name__ == "__main__":
    main()
