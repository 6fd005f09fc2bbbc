-- ARGV: id, token, elapsed_s.
return ack_one(ARGV[1], ARGV[2], tonumber(ARGV[3]), now_ms())
