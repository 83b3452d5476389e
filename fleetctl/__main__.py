from fleetctl.app import main

main()
