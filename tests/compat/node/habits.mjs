// The Node SDK's habits over time, for tests/gateway/test_amqp_sdk_refresh.py and
// test_amqp_sdk_idle.py: token renewal on the SDK's own timer, and an idle pause.
//
//   node habits.mjs '<job json>'      (or the job on stdin)
//
// A job is {"entity": "orders", "steps": [step, ...]} and either
//   "connectionString": "..."                    a key in a connection string, or
//   "host": "localhost:5671", "credential": {"uri", "keyName", "key", "ttlSeconds",
//                                            "claimedSeconds"}
//     an application's TokenCredential minting SAS tokens that live ttlSeconds and that it
//     says expire after claimedSeconds (the SDK renews two minutes before that);
// and optionally "idleTimeoutMs": the idle timeout the connection asks for in its open
// (the SDK has no option for it: it is @azure/core-amqp's default, 60 s, set here on the
// same module instance the SDK uses before the client is made).
// A step is
//   {"op": "send", "messageId": "..."}           one sendMessages call
//   {"op": "waitExpired", "token": i}            wait until the i-th token issued has
//                                                expired (one second past its se)
//   {"op": "idle", "ms": n}                      do nothing for n ms (the idle pause)
// It prints one JSON line: {"ok", "done": steps finished, "tokens": [se, ...], "error"?}.
import { createHmac } from "node:crypto";
import { createRequire } from "node:module";
import { setTimeout as delay } from "node:timers/promises";

const require = createRequire(import.meta.url);
// The CommonJS instances: the ones @azure/service-bus's own build requires.
const coreAmqp = require("@azure/core-amqp");
const { ServiceBusClient } = require("@azure/service-bus");

async function readJob() {
  if (process.argv[2]) return JSON.parse(process.argv[2]);
  const chunks = [];
  for await (const chunk of process.stdin) chunks.push(chunk);
  return JSON.parse(Buffer.concat(chunks).toString("utf8"));
}

function sasToken(uri, keyName, key, se) {
  const resource = encodeURIComponent(uri);
  const sig = createHmac("sha256", key).update(`${resource}\n${se}`).digest("base64");
  return `SharedAccessSignature sr=${resource}&sig=${encodeURIComponent(sig)}&se=${se}&skn=${keyName}`;
}

function shortLivedSas({ uri, keyName, key, ttlSeconds, claimedSeconds }, issued) {
  return {
    async getToken() {
      const se = Math.floor(Date.now() / 1000) + ttlSeconds;
      issued.push(se);
      return {
        token: sasToken(uri, keyName, key, se),
        expiresOnTimestamp: Date.now() + (claimedSeconds ?? ttlSeconds) * 1000,
      };
    },
  };
}

async function step(sender, s, issued) {
  switch (s.op) {
    case "send":
      await sender.sendMessages({ body: s.messageId, messageId: s.messageId });
      return;
    case "waitExpired": {
      const until = (issued[s.token] + 1) * 1000;
      while (Date.now() <= until) await delay(Math.min(200, until - Date.now() + 1));
      return;
    }
    case "idle":
      await delay(s.ms);
      return;
    default:
      throw new Error(`unknown op ${s.op}`);
  }
}

const job = await readJob();
if (job.idleTimeoutMs) coreAmqp.Constants.defaultConnectionIdleTimeoutInMs = job.idleTimeoutMs;
const issued = [];
const options = { retryOptions: { maxRetries: 0, timeoutInMs: job.timeoutMs ?? 15000 } };
const client = job.credential
  ? new ServiceBusClient(job.host, shortLivedSas(job.credential, issued), options)
  : new ServiceBusClient(job.connectionString, options);
let done = 0;
let out;
try {
  const sender = client.createSender(job.entity);
  for (const s of job.steps) {
    await step(sender, s, issued);
    done += 1;
  }
  await sender.close();
  out = { ok: true, done, tokens: issued };
} catch (err) {
  out = {
    ok: false,
    done,
    tokens: issued,
    error: { name: err?.name, code: err?.code, message: String(err?.message ?? err) },
  };
} finally {
  await client.close();
}
process.stdout.write(JSON.stringify(out) + "\n");
process.exitCode = out.ok ? 0 : 1;
