// The Node SDK's habits over time, for tests/gateway/test_amqp_sdk_refresh.py and
// test_amqp_sdk_idle.py, test_amqp_sdk_drain.py: token renewal on the SDK's own timer, an idle
// pause, a stream of sends through a drain.
//
//   node habits.mjs '<job json>'      (or the job on stdin)
//
// A job is {"entity": "orders", "steps": [step, ...]} and either
//   "connectionString": "..."                    a key in a connection string, or
//   "host": "localhost:5671", "credential": {"uri", "keyName", "key", "ttlSeconds",
//                                            "claimedSeconds"}
//     an application's TokenCredential minting SAS tokens that live ttlSeconds and that it
//     says expire after claimedSeconds (the SDK renews two minutes before that);
// and optionally "retry": the client's retryOptions (no retries unless given), and
// "idleTimeoutMs": the idle timeout the connection asks for in its open (the SDK has no
// option for it: it is @azure/core-amqp's default, 60 s, set here on the
// same module instance the SDK uses before the client is made).
// A step is
//   {"op": "send", "messageId": "..."}           one sendMessages call
//   {"op": "waitExpired", "token": i}            wait until the i-th token issued has
//                                                expired (one second past its se)
//   {"op": "idle", "ms": n}                      do nothing for n ms (the idle pause)
//   {"op": "stream", "prefix": "p", "count": n, "appRetries": r, "until": path}
//                                                send p-0, p-1... one after the other (n, or
//                                                more until the file `until` exists), each
//                                                acknowledged one listed in "acknowledged";
//                                                a send that fails is sent again up to r
//                                                times (the application's retry), each
//                                                error listed in "appRetried"
// It prints one JSON line: {"ok", "done": steps finished, "tokens": [se, ...],
// "acknowledged": [messageId, ...], "appRetried": [error, ...],
// "error"?: {name, code, message, retryable}}.
import { createHmac } from "node:crypto";
import { existsSync } from "node:fs";
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

function describe(err) {
  return {
    name: err?.name,
    code: err?.code,
    message: String(err?.message ?? err),
    retryable: err?.retryable,
  };
}

async function step(sender, s, issued, acknowledged) {
  switch (s.op) {
    case "stream":
      // Past "count" while the file "until" names does not exist (at most "max" sends).
      for (let i = 0; i < s.count || (s.until && !existsSync(s.until) && i < (s.max ?? 100000)); i++) {
        const messageId = `${s.prefix}-${i}`;
        for (let attempt = 0; ; attempt++) {
          try {
            await sender.sendMessages({ body: messageId, messageId });
            break;
          } catch (err) {
            // The application's own retry, on top of the SDK's (appRetries, 0 by default).
            if (attempt >= (s.appRetries ?? 0)) throw err;
            appRetried.push(describe(err));
          }
        }
        acknowledged.push(messageId);
      }
      return;
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
const acknowledged = [];
const appRetried = [];
const options = { retryOptions: { maxRetries: 0, timeoutInMs: 15000, ...job.retry } };
const client = job.credential
  ? new ServiceBusClient(job.host, shortLivedSas(job.credential, issued), options)
  : new ServiceBusClient(job.connectionString, options);
let done = 0;
let out;
try {
  const sender = client.createSender(job.entity);
  for (const s of job.steps) {
    await step(sender, s, issued, acknowledged);
    done += 1;
  }
  await sender.close();
  out = { ok: true, done, tokens: issued, acknowledged, appRetried };
} catch (err) {
  out = {
    ok: false,
    done,
    tokens: issued,
    acknowledged,
    appRetried,
    error: describe(err),
  };
} finally {
  try {
    await client.close();
  } catch {
    // closing after the gateway went away: the result is already decided
  }
}
process.stdout.write(JSON.stringify(out) + "\n");
process.exitCode = out.ok ? 0 : 1;
