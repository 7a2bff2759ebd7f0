{{- define "fsdp-operator.name" -}}fsdp-operator{{- end }}
{{- define "fsdp-operator.fullname" -}}{{ .Release.Name | trunc 40 | trimSuffix "-" }}-fsdp-operator{{- end }}
{{- define "fsdp-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}{{ default (include "fsdp-operator.fullname" .) .Values.serviceAccount.name }}{{ else }}{{ default "default" .Values.serviceAccount.name }}{{ end }}
{{- end }}
{{- define "fsdp-operator.labels" -}}
app.kubernetes.io/name: {{ include "fsdp-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end }}
{{- define "fsdp-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fsdp-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}
