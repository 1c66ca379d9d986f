{{/*
Names and labels.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "sbgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The full name of the release's objects: fullnameOverride, or <release>-<chart name> unless the
release name already contains the chart name. Truncated to 63 characters (DNS label limit).
*/}}
{{- define "sbgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The syphon Deployment's name. */}}
{{- define "sbgate.syphon.fullname" -}}
{{- printf "%s-syphon" (include "sbgate.fullname" . | trunc 56 | trimSuffix "-") -}}
{{- end -}}

{{/* Chart name and version, for the helm.sh/chart label. */}}
{{- define "sbgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "sbgate.labels" -}}
helm.sh/chart: {{ include "sbgate.chart" . }}
{{ include "sbgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sbgate
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels that select the release's pods; add app.kubernetes.io/component to pick one kind. */}}
{{- define "sbgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sbgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* metadata.annotations for every object, from commonAnnotations (and extra ones given). */}}
{{- define "sbgate.annotations" -}}
{{- $all := merge (dict) (.extra | default dict) (.context.Values.commonAnnotations | default dict) -}}
{{- with $all }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The ServiceAccount the pods run as. */}}
{{- define "sbgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "sbgate.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The image reference: [registry/]repository, then @digest or :tag (default appVersion). */}}
{{- define "sbgate.image" -}}
{{- $repo := .Values.image.repository -}}
{{- if .Values.image.registry -}}
{{- $repo = printf "%s/%s" .Values.image.registry $repo -}}
{{- end -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $repo .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end -}}
{{- end -}}

{{/*
Secrets. Each one comes from an existing Secret, or from the chart's own Secret when its value is
given inline. "sbgate.secretName" is the chart's Secret.
*/}}
{{- define "sbgate.secretName" -}}
{{- include "sbgate.fullname" . -}}
{{- end -}}

{{/* Non-empty when the chart must create its own Secret. */}}
{{- define "sbgate.createSecret" -}}
{{- $sb := .Values.serviceBus -}}
{{- if and (not $sb.existingSecret) (or $sb.primary.connectionString $sb.secondary.connectionString) -}}true{{- end -}}
{{- if and (not .Values.redis.existingSecret) .Values.redis.url -}}true{{- end -}}
{{- if and (not .Values.auth.existingSecret) .Values.auth.rules -}}true{{- end -}}
{{- end -}}

{{/* Non-empty when Redis is configured. */}}
{{- define "sbgate.redis.enabled" -}}
{{- if or .Values.redis.existingSecret .Values.redis.url -}}true{{- end -}}
{{- end -}}

{{/* Non-empty when a SAS rules file is configured. */}}
{{- define "sbgate.auth.enabled" -}}
{{- if or .Values.auth.existingSecret .Values.auth.rules -}}true{{- end -}}
{{- end -}}

{{/* Non-empty when a TOML configuration file is mounted. */}}
{{- define "sbgate.configFile.enabled" -}}
{{- if or .Values.config.existingConfigmap .Values.config.file -}}true{{- end -}}
{{- end -}}

{{/*
How one namespace role ("primary" or "secondary") is reached: "namespace" (azure-identity),
"existingSecret", "secret" (the chart's Secret) or "" (not configured).
Usage: include "sbgate.serviceBus.source" (dict "role" "primary" "context" $)
*/}}
{{- define "sbgate.serviceBus.source" -}}
{{- $sb := .context.Values.serviceBus -}}
{{- $ns := get $sb .role -}}
{{- if $ns.namespace -}}namespace
{{- else if $sb.existingSecret -}}existingSecret
{{- else if $ns.connectionString -}}secret
{{- end -}}
{{- end -}}

{{/*
Number formatting for environment values: toJson writes integers without an exponent
(1048576, not 1.048576e+06) and keeps fractions (2.5).
*/}}
{{- define "sbgate.envValue" -}}
{{- if kindIs "string" . -}}{{ . }}{{- else -}}{{ toJson . }}{{- end -}}
{{- end -}}

{{/*
Grace period: preStop sleep + drain delay + shutdown timeout + margin for closing the clients,
rounded up. An explicit terminationGracePeriodSeconds shorter than that is refused.
*/}}
{{- define "sbgate.minGracePeriod" -}}
{{- $preStop := ternary .Values.preStop.sleepSeconds 0 .Values.preStop.enabled -}}
{{- addf $preStop .Values.config.drainDelay .Values.config.shutdownTimeout .Values.shutdownMarginSeconds | ceil | int -}}
{{- end -}}

{{- define "sbgate.terminationGracePeriodSeconds" -}}
{{- $min := include "sbgate.minGracePeriod" . | int -}}
{{- if eq (toString .Values.terminationGracePeriodSeconds) "" -}}
{{- $min -}}
{{- else -}}
{{- int .Values.terminationGracePeriodSeconds -}}
{{- end -}}
{{- end -}}

{{/*
Pod affinity presets (soft: preferred, hard: required), one pod per node.
Usage: include "sbgate.affinityTerm" (dict "type" "soft" "component" "gateway" "context" $)
*/}}
{{- define "sbgate.affinityTerm" -}}
{{- $labels := include "sbgate.selectorLabels" .context | fromYaml -}}
{{- $_ := set $labels "app.kubernetes.io/component" .component -}}
{{- if eq .type "soft" -}}
preferredDuringSchedulingIgnoredDuringExecution:
  - weight: 100
    podAffinityTerm:
      labelSelector:
        matchLabels:
          {{- toYaml $labels | nindent 10 }}
      topologyKey: kubernetes.io/hostname
{{- else if eq .type "hard" -}}
requiredDuringSchedulingIgnoredDuringExecution:
  - labelSelector:
      matchLabels:
        {{- toYaml $labels | nindent 8 }}
    topologyKey: kubernetes.io/hostname
{{- end -}}
{{- end -}}

{{/*
Checks that refuse values which would deploy a gateway that cannot start. Included by the
Deployment template, so `helm install` and `helm template` stop with the message.
*/}}
{{- define "sbgate.validateValues" -}}
{{- $msgs := list -}}
{{- $sb := .Values.serviceBus -}}
{{- if not .Values.config.entities -}}
{{- $msgs = append $msgs "config.entities: declare at least one entity, e.g. [\"queue:orders\"] (SBGATE_ENTITIES)" -}}
{{- end -}}
{{- if eq (include "sbgate.serviceBus.source" (dict "role" "primary" "context" .)) "" -}}
{{- $msgs = append $msgs "serviceBus: set serviceBus.primary.connectionString, serviceBus.existingSecret, or serviceBus.primary.namespace (azure-identity)" -}}
{{- end -}}
{{- range $role := list "primary" "secondary" -}}
{{- $ns := get $sb $role -}}
{{- if and $ns.namespace $ns.connectionString -}}
{{- $msgs = append $msgs (printf "serviceBus.%s: set either connectionString or namespace, not both" $role) -}}
{{- end -}}
{{- if and $ns.namespace (not (contains "." $ns.namespace)) -}}
{{- $msgs = append $msgs (printf "serviceBus.%s.namespace: give the fully qualified name, e.g. %s.servicebus.windows.net" $role $ns.namespace) -}}
{{- end -}}
{{- end -}}
{{- if and (not (include "sbgate.auth.enabled" .)) (not .Values.auth.allowOpen) -}}
{{- $msgs = append $msgs "auth: set auth.rules or auth.existingSecret (SAS keys), or auth.allowOpen=true to run without authorization" -}}
{{- end -}}
{{- if and .Values.workloadIdentity.enabled (not .Values.workloadIdentity.clientId) (not (hasKey .Values.serviceAccount.annotations "azure.workload.identity/client-id")) -}}
{{- $msgs = append $msgs "workloadIdentity.clientId: the client ID of the identity is required with workloadIdentity.enabled" -}}
{{- end -}}
{{- if and (eq .Values.redis.credential "workload") (not .Values.workloadIdentity.enabled) -}}
{{- $msgs = append $msgs "redis.credential=workload uses the pod's workload identity: set workloadIdentity.enabled (or pick managed)" -}}
{{- end -}}
{{- if and (eq .Values.redis.mode "sentinel") (include "sbgate.redis.enabled" .) .Values.redis.url (not (hasPrefix "redis+sentinel://" .Values.redis.url)) (not (hasPrefix "rediss+sentinel://" .Values.redis.url)) -}}
{{- $msgs = append $msgs "redis.url: redis.mode=sentinel takes a redis+sentinel://h1:26379,h2:26379/<master>/0 URL" -}}
{{- end -}}
{{- if and .Values.audit.enabled (not .Values.audit.args) -}}
{{- $msgs = append $msgs "audit.args: the audit's arguments are required with audit.enabled (at least --ledger, --delivered and --out)" -}}
{{- end -}}
{{- if ne (toString .Values.terminationGracePeriodSeconds) "" -}}
{{- $min := include "sbgate.minGracePeriod" . | int -}}
{{- if lt (int .Values.terminationGracePeriodSeconds) $min -}}
{{- $msgs = append $msgs (printf "terminationGracePeriodSeconds=%d is shorter than preStop.sleepSeconds + config.drainDelay + config.shutdownTimeout + shutdownMarginSeconds = %d" (int .Values.terminationGracePeriodSeconds) $min) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.ingress.enabled (not .Values.ingress.hosts) (not .Values.config.publicHosts) -}}
{{- $msgs = append $msgs "ingress.hosts: give the host names clients use (or config.publicHosts, which the Ingress then routes)" -}}
{{- end -}}
{{- if $msgs -}}
{{- fail (printf "\n\nsbgate: invalid values:\n  - %s\n" (join "\n  - " $msgs)) -}}
{{- end -}}
{{- end -}}

{{/*
Pieces shared by the gateway and syphon containers.
*/}}

{{/* Environment besides the ConfigMap's: pod identity, listen address, secrets. */}}
{{- define "sbgate.env" -}}
{{- $sb := .Values.serviceBus -}}
- name: SBGATE_REPLICA_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: SBGATE_LISTEN_HOST
  value: "0.0.0.0"
- name: SBGATE_LISTEN_PORT
  value: {{ .Values.containerPorts.http | toString | quote }}
{{- if .Values.containerPorts.probe }}
- name: SBGATE_PROBE_PORT
  value: {{ .Values.containerPorts.probe | toString | quote }}
{{- end }}
{{- range $role := list "primary" "secondary" }}
{{- $source := include "sbgate.serviceBus.source" (dict "role" $role "context" $) }}
{{- if eq $source "existingSecret" }}
- name: SBGATE_{{ upper $role }}_CONNECTION_STRING
  valueFrom:
    secretKeyRef:
      name: {{ $sb.existingSecret }}
      key: {{ get $sb (printf "existingSecret%sKey" (title $role)) }}
      {{- if eq $role "secondary" }}
      optional: true
      {{- end }}
{{- else if eq $source "secret" }}
- name: SBGATE_{{ upper $role }}_CONNECTION_STRING
  valueFrom:
    secretKeyRef:
      name: {{ include "sbgate.secretName" $ }}
      key: {{ $role }}-connection-string
{{- end }}
{{- end }}
{{- if include "sbgate.redis.enabled" . }}
- name: SBGATE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret | default (include "sbgate.secretName" .) }}
      key: {{ ternary .Values.redis.existingSecretKey "redis-url" (ne .Values.redis.existingSecret "") }}
- name: SBGATE_REDIS_MODE
  value: {{ .Values.redis.mode | quote }}
{{- if ne .Values.redis.credential "none" }}
- name: SBGATE_REDIS_CREDENTIAL
  value: {{ .Values.redis.credential | quote }}
{{- end }}
{{- if include "sbgate.redis.ca.enabled" . }}
- name: SBGATE_REDIS_CA_FILE
  value: /etc/sbgate-redis-ca/{{ .Values.redis.ca.key }}
{{- end }}
{{- end }}
{{- if include "sbgate.auth.enabled" . }}
- name: SBGATE_AUTH_RULES_FILE
  value: /etc/sbgate/{{ .Values.auth.fileName }}
{{- end }}
{{- with .Values.extraEnvVars }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* A private CA for Redis, from a Secret or a ConfigMap: "true" or "". */}}
{{- define "sbgate.redis.ca.enabled" -}}
{{- if and (include "sbgate.redis.enabled" .) (or .Values.redis.ca.secretName .Values.redis.ca.configMapName) -}}true{{- end -}}
{{- end -}}

{{/* Volumes: /tmp, and /etc/sbgate with the config file and the SAS rules (read-only). */}}
{{- define "sbgate.volumes" -}}
- name: tmp
  emptyDir:
    {{- with .Values.tmpDir.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- if or (include "sbgate.configFile.enabled" .) (include "sbgate.auth.enabled" .) }}
- name: etc-sbgate
  projected:
    defaultMode: 0440
    sources:
      {{- if include "sbgate.configFile.enabled" . }}
      - configMap:
          name: {{ .Values.config.existingConfigmap | default (printf "%s-file" (include "sbgate.fullname" .)) }}
          items:
            - key: config.toml
              path: config.toml
      {{- end }}
      {{- if include "sbgate.auth.enabled" . }}
      - secret:
          name: {{ .Values.auth.existingSecret | default (include "sbgate.secretName" .) }}
          items:
            - key: {{ ternary .Values.auth.existingSecretKey "auth-rules" (ne .Values.auth.existingSecret "") }}
              path: {{ .Values.auth.fileName }}
      {{- end }}
{{- end }}
{{- if include "sbgate.redis.ca.enabled" . }}
- name: redis-ca
  {{- if .Values.redis.ca.secretName }}
  secret:
    secretName: {{ .Values.redis.ca.secretName }}
  {{- else }}
  configMap:
    name: {{ .Values.redis.ca.configMapName }}
  {{- end }}
    defaultMode: 0444
    items:
      - key: {{ .Values.redis.ca.key }}
        path: {{ .Values.redis.ca.key }}
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "sbgate.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if or (include "sbgate.configFile.enabled" .) (include "sbgate.auth.enabled" .) }}
- name: etc-sbgate
  mountPath: /etc/sbgate
  readOnly: true
{{- end }}
{{- if include "sbgate.redis.ca.enabled" . }}
- name: redis-ca
  mountPath: /etc/sbgate-redis-ca
  readOnly: true
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod template annotations that roll the pods when their configuration changes. */}}
{{- define "sbgate.checksums" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
checksum/secret: {{ include (print .Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end -}}

{{/*
An HTTP probe from a probe's values (without "enabled"): on the probe port, which overload never
closes, when containerPorts.probe is set, else on the http port.
*/}}
{{- define "sbgate.httpProbe" -}}
httpGet:
  path: {{ .path }}
  port: {{ ternary "probe" "http" (not (empty .context.Values.containerPorts.probe)) }}
{{ omit .probe "enabled" | toYaml }}
{{- end -}}

{{/* The audit image: image.registry + audit.image.repository, tag default appVersion. */}}
{{- define "sbgate.audit.image" -}}
{{- $repo := .Values.audit.image.repository -}}
{{- if .Values.image.registry -}}
{{- $repo = printf "%s/%s" .Values.image.registry $repo -}}
{{- end -}}
{{- printf "%s:%s" $repo (.Values.audit.image.tag | default .Chart.AppVersion | toString) -}}
{{- end -}}

{{/*
The Entra ID credential for namespaces given by name (SBGATE_AZURE_CREDENTIAL): the value of
serviceBus.credential, else "workload" when workload identity is on, else none (the gateway's
default).
*/}}
{{- define "sbgate.azureCredential" -}}
{{- if .Values.serviceBus.credential -}}{{ .Values.serviceBus.credential }}
{{- else if .Values.workloadIdentity.enabled -}}workload
{{- end -}}
{{- end -}}

{{/*
Observability: the alerts' series selector, the Ingress's annotations and paths.
*/}}

{{/*
PromQL label matchers for this release's series: metrics.prometheusRule.selector, or the
namespace and the Services the chart's ServiceMonitor scrapes (it labels every series with
`namespace` and `service`).
*/}}
{{- define "sbgate.promSelector" -}}
{{- with .Values.metrics.prometheusRule.selector -}}
{{- . -}}
{{- else -}}
{{- printf "namespace=%q, service=~%q" .Release.Namespace (printf "%s|%s" (include "sbgate.fullname" .) (include "sbgate.syphon.fullname" .)) -}}
{{- end -}}
{{- end -}}

{{/*
The Ingress's annotations: with ingress.nginxAnnotations, what ingress-nginx needs to pass the
gateway's traffic as the gateway expects (docs/observability.md explains each); then
ingress.annotations, which win.
*/}}
{{- define "sbgate.ingress.annotations" -}}
{{- $out := dict -}}
{{- if .Values.ingress.nginxAnnotations -}}
{{- /* Continue the client's W3C trace (traceparent) when the controller traces. */ -}}
{{- $_ := set $out "nginx.ingress.kubernetes.io/opentelemetry-trust-incoming-span" "true" -}}
{{- /* Admit every body the gateway admits (a smaller cluster-wide limit would refuse them). */ -}}
{{- $maxBody := get .Values.config.extraEnv "SBGATE_MAX_BODY_BYTES" | default 1048576 -}}
{{- $_ := set $out "nginx.ingress.kubernetes.io/proxy-body-size" (include "sbgate.envValue" $maxBody) -}}
{{- end -}}
{{- merge (deepCopy .Values.ingress.annotations) $out | toYaml -}}
{{- end -}}

{{/*
The Ingress paths: ingress.paths, or each entity's message paths — the Service Bus form
/<entity>/messages (and /Messages) and /queues|topics/<entity>/messages — then
ingress.extraPaths. Operational endpoints (/metrics, /admin, /openapi.json, the probes) are
not routed unless listed.
*/}}
{{- define "sbgate.ingress.paths" -}}
{{- $paths := list -}}
{{- if .Values.ingress.paths -}}
{{- $paths = .Values.ingress.paths -}}
{{- else -}}
{{- range .Values.config.entities -}}
{{- $spec := split "@" . -}}
{{- $parts := splitList ":" $spec._0 -}}
{{- $kind := ternary (first $parts) "queue" (eq (len $parts) 2) -}}
{{- $entity := last $parts -}}
{{- range $p := list (printf "/%s/messages" $entity) (printf "/%s/Messages" $entity) (printf "/%ss/%s/messages" $kind $entity) -}}
{{- $paths = append $paths (dict "path" $p "pathType" "Prefix") -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $paths = concat $paths .Values.ingress.extraPaths -}}
{{- range $paths }}
- path: {{ .path | quote }}
  pathType: {{ .pathType | default "Prefix" }}
  backend:
    service:
      name: {{ include "sbgate.fullname" $ }}
      port:
        name: http
{{- end }}
{{- end -}}


{{/*
One alerting rule of the PrometheusRule, when its alerts.<key>.enabled.
Usage: include "sbgate.alertRule" (dict "name" "SbgateX" "cfg" $alerts.x "expr" "..."
         "summary" "..." "description" "..." "runbook" "..." "context" $)
*/}}
{{- define "sbgate.alertRule" -}}
{{- if .cfg.enabled }}
- alert: {{ .name }}
  expr: |-
    {{- .expr | nindent 4 }}
  {{- with .cfg.for }}
  for: {{ . }}
  {{- end }}
  labels:
    severity: {{ .cfg.severity | quote }}
    {{- with .context.Values.metrics.prometheusRule.alertLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    summary: {{ .summary | quote }}
    description: {{ .description | quote }}
    runbook: {{ .runbook | quote }}
    {{- with .context.Values.metrics.prometheusRule.runbookUrl }}
    runbook_url: {{ printf "%s#%s" . (lower $.name) | quote }}
    {{- end }}
{{- end }}
{{- end -}}

{{/* The AMQP edge's settings (gateway container only; docs/amqp.md). */}}
{{- define "sbgate.amqp.env" -}}
{{- $a := .Values.amqp -}}
- name: SBGATE_AMQP_PORT
  value: {{ $a.port | toString | quote }}
- name: SBGATE_AMQP_TLS_CERT_FILE
  value: /etc/sbgate-amqp-tls/tls.crt
- name: SBGATE_AMQP_TLS_KEY_FILE
  value: /etc/sbgate-amqp-tls/tls.key
{{- if not (kindIs "invalid" $a.maxConnectionAge) }}
- name: SBGATE_AMQP_MAX_CONNECTION_AGE
  value: {{ include "sbgate.envValue" $a.maxConnectionAge | quote }}
{{- end }}
{{- if not (kindIs "invalid" $a.linkCredit) }}
- name: SBGATE_AMQP_LINK_CREDIT
  value: {{ include "sbgate.envValue" $a.linkCredit | quote }}
{{- end }}
{{- if not (kindIs "invalid" $a.maxConnections) }}
- name: SBGATE_AMQP_MAX_CONNECTIONS
  value: {{ include "sbgate.envValue" $a.maxConnections | quote }}
{{- end }}
{{- end -}}
