"""Read and change our nftables table through libnftables, or an ``nft`` process."""
