"""Expert parallelism (mixture of experts): each rank holds some of the experts, and every
token goes to the rank of the expert its router picked and back.

    ep_comms.py  all_to_all_rows: the dispatch (and, as its backward, the combine) of rows
                 between ranks, in parts as uneven as the routing makes them
"""

from paratrain.parallel.expert.ep_comms import all_to_all_rows

__all__ = ["all_to_all_rows"]
