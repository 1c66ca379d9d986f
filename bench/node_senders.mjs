// Single sends from the real Node SDK (@azure/service-bus, installed by `make node-deps`
// under tests/compat/node), the AMQP edge bench's cheaper client:
//
//   node bench/node_senders.mjs '{"connectionString": "...", "entity": "orders",
//                                 "messages": 4000, "senders": 4, "inFlight": 1}'
//
// `senders` senders on one client, each with `inFlight` sendMessages calls of one message
// (1 KiB) outstanding at a time, until `messages` are sent in all. Prints one JSON line:
// {"ok": true, "sent": n, "seconds": s} (or {"ok": false, "error": "..."}, exit 1).
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";
import path from "node:path";

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, "..", "tests", "compat", "node", "package.json"));
const { ServiceBusClient } = require("@azure/service-bus");

const job = JSON.parse(process.argv[2]);
const body = Buffer.alloc(1024, "x");
const client = new ServiceBusClient(job.connectionString, { retryOptions: { maxRetries: 0 } });
let left = job.messages;
try {
  const senders = Array.from({ length: job.senders }, () => client.createSender(job.entity));
  // Each link opened before the clock, as a long-lived application's are.
  await Promise.all(senders.map((s) => s.sendMessages({ body })));
  const started = process.hrtime.bigint();
  let sent = 0;
  const loop = async (sender) => {
    while (left > 0) {
      left -= 1;
      await sender.sendMessages({ body });
      sent += 1;
    }
  };
  await Promise.all(senders.flatMap((s) => Array.from({ length: job.inFlight }, () => loop(s))));
  const seconds = Number(process.hrtime.bigint() - started) / 1e9;
  await client.close();
  console.log(JSON.stringify({ ok: true, sent, seconds }));
} catch (e) {
  console.log(JSON.stringify({ ok: false, error: String(e) }));
  await client.close();
  process.exit(1);
}
