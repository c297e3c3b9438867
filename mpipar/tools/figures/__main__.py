from mpipar.tools.figures import main

main()
