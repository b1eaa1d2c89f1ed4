"""local/: the local swarm (`swarmrl up`): its processes, outputs, endpoints and the network-namespace
test bed; a trainer in this process with clients that open no socket (`inprocess.py`)."""
