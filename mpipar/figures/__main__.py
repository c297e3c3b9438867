from mpipar.figures import main

main()
