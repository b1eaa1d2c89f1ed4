"""local/: the local swarm (`swarmrl up`): its processes, outputs, endpoints and the network-namespace
test bed."""
